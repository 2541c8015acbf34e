"""The compressed KV cache: packed codes only, in a store that grows in steps.

Token positions of one layer are laid out as

    [0, sinks)                      fp16 attention sinks (config.sink_tokens)
    [sinks, sinks + encoded)        packed codes, the only copy of these tokens (`storage.py`)
    [sinks + encoded, offset)       fp16 recent window (config.residual_length)

A prefill chunk attends the way decoding would: a query at position p sees a
key in fp16 exactly when that key would still be in the sinks or the window
when p was the newest token. Tokens the chunk itself pushes out of the window
are therefore also scored from their fp16 values (held only for this call) by
queries for which they were still recent, so results do not depend on the
chunk size.

With `config.center`, codes hold k - mean_k and v - mean_v (one fp16 vector per
head, from the first encoded chunk). Attention scores fp16 keys as k - mean_k
too, a shift of every score of a query by the same q.mean_k, which softmax
ignores; encoded values get mean_v back before they are summed.

Tokens leave the window in multiples of the codecs' `token_block` once more
than `residual_length` of them wait there. `nbytes` is the sum of the live
buffers, unused capacity included.

Where a "decode_store" path can slide a full window (the turboquant_mse kernels), a
decode token waits in `incoming` for the attention call, whose kernel encodes and
stores the window's oldest token and writes the new one in its slot: the window is
then a ring starting at `window_start`. Anything else that reads the cache first
(`flush`) slides it op by op, and `window_keys` / `window_values` are always in
position order.

The cache keeps the positions (sinks, window, offset, trim) and hands attention a
read-only `engine.History`; the codes live in a `storage` class chosen from the
codecs' formats, and the attention path comes from the engine's registry, with the
settings (`settings.EngineSettings`) resolved once when the cache is made.
"""

from .compressed import CompressedKVCache
from .errors import FP16_MAX, CacheFormatError, CacheInputError
from .persistence import _DENSE_STATE, _LOADING, FORMAT_VERSION, register_on_load, run_on_load  # noqa: F401  (rotating, attention_hook)
from .protocol import CompressedHistory, DecodedReads, register_batch

__all__ = ["FORMAT_VERSION", "FP16_MAX", "CacheFormatError", "CacheInputError", "CompressedHistory",
           "CompressedKVCache", "DecodedReads", "register_batch", "register_on_load"]
