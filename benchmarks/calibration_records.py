"""Collect the calibration records of eval specs' artifact dirs into one calibration.json, in the
format `calibrated_table.py --calibration` reads.

    python benchmarks/calibration_records.py --out benchmarks/results/commvq-calib/calibration.json \
        "commvq:1:vbits=4,artifacts=benchmarks/results/commvq-calib/artifacts/k1v4" ...

Each artifact dir's artifacts.json holds the record `veloxquant calibrate` wrote (capture and learn
seconds, tokens, text).
"""

import argparse
import json
from pathlib import Path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("specs", nargs="+", help="eval specs with artifacts=DIR")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    configs = {}
    for spec in args.specs:
        folder = spec.split("artifacts=")[1].split(",")[0]
        record = json.loads((Path(folder) / "artifacts.json").read_text())["calibration"]
        configs[Path(folder).name] = {"spec": spec, "calibration_seconds": record["seconds"], **record}
    Path(args.out).write_text(json.dumps({"configs": configs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
