"""Measurement harness: perplexity, needle in a haystack, speed/memory benchmarks, reports."""

from .cli import register_benchmark_cli, register_cli, register_eval_cli, register_report_cli
from .specs import MethodSpec, MethodSpecError, parse_method_list, parse_method_spec
from .watchdog import MemoryGuard, MemoryGuardTriggered, available_memory_bytes

__all__ = [
    "MemoryGuard",
    "MemoryGuardTriggered",
    "MethodSpec",
    "MethodSpecError",
    "available_memory_bytes",
    "parse_method_list",
    "parse_method_spec",
    "register_benchmark_cli",
    "register_cli",
    "register_eval_cli",
    "register_report_cli",
]
