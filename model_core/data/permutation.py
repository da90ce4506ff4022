"""A keyed pseudo-random permutation of [0, size), computed per element: row order without a row array.

`KeyedPermutation(size, key)` is a balanced Feistel network on the smallest even bit width w with
2**w >= size (w >= 2), six rounds, each round function a splitmix64 finaliser of the right half xor a round
key (itself splitmix64 of the key's words and the round number). A Feistel network is a bijection of
[0, 2**w) for any round function; cycle walking (encrypt again while the value is >= size) restricts it to a
bijection of [0, size). Since 2**w < 4 * size, an element needs fewer than 4 encryptions on average.
Everything is uint64 numpy arithmetic on the given positions (memory proportional to the batch, not to
size) and wraps the same way on every platform, so the same (size, key) is the same order everywhere.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_MASK64 = (1 << 64) - 1
_MAX_SIZE = 1 << 63  # row indices are int64


def _splitmix64(value: int) -> int:
    """splitmix64's step and finaliser on a Python int (the round keys)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (multiplications wrap modulo 2**64)."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class KeyedPermutation:
    """A bijection of [0, size) chosen by `key`: `forward(positions) -> rows`, `inverse(rows) -> positions`.

    Key words are integers in [-2**63, 2**64) (negative ones taken modulo 2**64).
    """

    def __init__(self, size: int, key: tuple[int, ...]) -> None:
        if not 0 <= size <= _MAX_SIZE:
            raise ValueError(f"permutation size {size} is outside [0, 2**63]")
        self.size = size
        self.key = tuple(key)
        bits = max(1, (size - 1).bit_length())  # the smallest b with 2**b >= size
        width = bits + (bits & 1)
        self._half = np.uint64(width // 2)
        self._half_mask = np.uint64((1 << (width // 2)) - 1)
        state = _splitmix64(len(self.key))
        for word in self.key:
            if not -(1 << 63) <= word <= _MASK64:
                raise ValueError(f"permutation key word {word} is outside [-2**63, 2**64)")
            state = _splitmix64(state ^ (word & _MASK64))
        self._round_keys = [np.uint64(_splitmix64(state ^ round_index)) for round_index in range(_ROUNDS)]

    def forward(self, positions: np.ndarray) -> np.ndarray:
        """The rows at the given positions of the order (uint64, same shape)."""
        return self._walk(positions, self._encrypt)

    def inverse(self, rows: np.ndarray) -> np.ndarray:
        """The positions of the given rows in the order (uint64, same shape)."""
        return self._walk(rows, self._decrypt)

    def _walk(self, values: np.ndarray, step) -> np.ndarray:
        values = np.asarray(values)
        if values.size and (values.min() < 0 or values.max() >= self.size):
            raise ValueError(f"values outside [0, {self.size}) given to a permutation of size {self.size}")
        if self.size <= 1:
            return values.astype(np.uint64)
        out = step(values.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.size))
        while len(outside):  # every cycle through a value below size returns below size
            out[outside] = step(out[outside])
            outside = outside[out[outside] >= np.uint64(self.size)]
        return out

    def _round(self, half: np.ndarray, round_index: int) -> np.ndarray:
        return _mix(half ^ self._round_keys[round_index]) & self._half_mask

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self._half, values & self._half_mask
        for round_index in range(_ROUNDS):
            left, right = right, left ^ self._round(right, round_index)
        return (left << self._half) | right

    def _decrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self._half, values & self._half_mask
        for round_index in reversed(range(_ROUNDS)):
            left, right = right ^ self._round(left, round_index), left
        return (left << self._half) | right
