"""The codec protocol: what a method's key or value codec does with a stream of head vectors
(`base.py` has the method protocol and registry)."""

from __future__ import annotations

from typing import Dict

import mlx.core as mx

from ..formats import Format

Fields = Dict[str, mx.array]
Params = Dict[str, mx.array]

POSITIONS = "positions"  # the extra entry `at_positions` gives a positional codec's fields


def at_positions(codec: "Codec", fields: Fields, first: int) -> Fields:
    """`fields` of consecutive tokens at absolute positions first, first + 1, ... as `codec`
    decodes them: a positional codec (`Codec.positional`) reads the positions from an extra
    entry (the store does not hold them: a token's position is its place in the history);
    any other codec gets `fields` unchanged."""
    if not codec.positional:
        return fields
    count = next(iter(fields.values())).shape[2]
    return {**fields, POSITIONS: mx.arange(first, first + count)}


def split_width_centroid(a, parts, books) -> str:
    """The C expression of element j's centroid for codes stored in consecutive parts of several
    widths, `parts` = [(field, first, stop, bits)] and `books` {bits: codebook} (ratequant's and
    spectralquant's `kernel_decode`, `kernels/dequant.py`); each part's index is clamped so that
    every load stays in its field."""
    value = None
    for name, start, stop, bits in reversed(parts):  # the last part's term is innermost
        index = f"(j < {start} ? 0 : VQ_MINI(j - {start}, {stop - start - 1}))"
        term = f"{a.table(books[bits].centroids)}[{a.code(name, index)}]"
        value = term if value is None else f"(j < {stop} ? {term} : {value})"
    return value


class Codec:
    """Compresses one stream (keys or values) of vectors of size `dim`."""

    dim: int
    domain_dim: int
    format: Format  # what it stores (`formats.py`); set by each codec's constructor
    # A positional codec applies a position-dependent map itself (commvq: RoPE at attention
    # time): the cache hands `encode` `position_free(keys, first)`, and every reader passes the
    # fields through `at_positions`. Only for per-token formats whose tokens stay in position
    # order (no sliding-window eviction).
    positional: bool = False

    @property
    def token_block(self) -> int:
        return self.format.token_block

    def encode(self, x: mx.array) -> Fields:
        raise NotImplementedError

    def position_free(self, x: mx.array, first: int) -> mx.array:
        """A positional codec's input: tokens (B, H, T, D) at positions first.. with the
        position's map taken off (what `encode` codes)."""
        return x

    def decode(self, fields: Fields) -> mx.array:
        """Decoded vectors in the codec's domain, float32 (..., T, domain_dim)."""
        raise NotImplementedError

    def to_domain(self, x: mx.array) -> mx.array:
        """The linear map A into the domain. Value codecs need A^T A = I (an
        orthogonal or identity domain): the cache adds A mean_v to decoded values."""
        return x

    def from_domain(self, y: mx.array) -> mx.array:
        return y

    @property
    def domain(self) -> str:
        """What from_domain is, for kernels that leave the domain themselves: "identity",
        "rotation" (self.rotation.invert; codecs say so by overriding this), or "custom"."""
        return "identity" if type(self).from_domain is Codec.from_domain else "custom"

    def params(self) -> Params:
        """Constant arrays (codebooks, rotations) that rebuild this codec exactly."""
        return {}

    def bits_per_token(self) -> float:
        """Storage budget of one token of one head, in bits (its fields on their own)."""
        return self.format.bits_per_token

    def reconstruct(self, fields: Fields) -> mx.array:
        return self.from_domain(self.decode(fields))

    def score(self, queries: mx.array, fields: Fields) -> mx.array:
        """queries (B, H, M, domain_dim) float32 in the domain . decode(fields) (B, H, T) tokens
        -> scores (B, H, M, T): ggml's vec_dot. Codecs whose codes MLX can multiply without
        decoding them override this."""
        return queries @ self.decode(fields).astype(mx.float32).swapaxes(-1, -2)

    def weighted_sum(self, weights: mx.array, fields: Fields) -> mx.array:
        """sum_t weights[..., t] * decode(fields)[t]: attention's value sum in the domain.
        `weights` (B, H, R, L, T) float32 (R query heads per kv head), fields of (B, H, T)
        tokens -> (B, H, R, L, domain_dim). Codecs whose codes MLX can multiply without
        decoding them override this."""
        return weights @ mx.expand_dims(self.decode(fields).astype(mx.float32), 2)
