"""``uint8_tensor.bernoulli_(p)`` on the CPU, the same draw bit for bit, three to five times faster.

Dropout's mask on the CPU is ``bernoulli_``'s (``native_dropout`` draws it; slimact's attention draws it again in
the backward instead of keeping it). In torch's CPU build that kernel is a serial loop over the generator: per
element ``random64()`` (two 32-bit words of the generator's mt19937, the first the high half), ``x = bits & (2**53
- 1)`` and ``keep = x * 2**-53 < p`` in float64, whatever the tensor's dtype. It takes ~5 ns an element (16 ms
for GPT-2's ``[4, 12, 256, 256]`` attention mask at 4 x 256 tokens), and a dropout-0.1 GPT-2 block draws
three such masks forward, one more backward.

The same stream comes out of the generator's state (``Generator.get_state()``: the mt19937 words, the index of
the next one, the count left before the next twist) through a small C kernel whose loops the compiler
vectorises: the twist of the 624 words in its three independent runs, the tempering of a block of words, and the
comparison ``x < ceil(p * 2**53)`` (the same as the float64 one: ``x * 2**-53`` and ``p * 2**53`` are exact).
It writes the mask and advances the state by as many words as the kernel would have used; the state is set back
on the generator, so every later draw is the one it would have been.

It is taken for a contiguous uint8 CPU tensor of at least :data:`MIN_NUMEL` elements; else (and with
``SLIMACT_BACKEND=reference``, without a C compiler, or where the first use's self-check against ``bernoulli_``
finds any difference: another torch's generator) ``bernoulli_`` runs. The kernel is compiled once per machine
(``cc -O3``, well under a second) into slimact's cache directory (``$SLIMACT_CACHE_DIR``, else
``$XDG_CACHE_HOME/slimact`` or ``~/.cache/slimact``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from slimact.quant import backend_for

__all__ = ["MIN_NUMEL", "bernoulli_"]

#: Smallest mask drawn by the kernel: below it the state's round trip (two 5 KB copies) is not repaid.
MIN_NUMEL = 1 << 14

#: ``Generator.get_state()`` of torch's CPU generator: ``{uint64 seed; int32 left; int32 seeded; uint64 next;
#: uint64 words[624]; ...}`` (``CPUGeneratorImplStateLegacy``), 5056 bytes.
_STATE_BYTES = 5056

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

enum { N = 624, M = 397 };

static inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

/* at::mt19937::next_state, in its three runs (each without a dependency inside its vector width). */
static void next_state(uint32_t *s) {
  int i;
  for (i = 0; i < N - M; i++) s[i] = s[i + M] ^ twist(s[i], s[i + 1]);
  for (; i < N - 1; i++) s[i] = s[i + M - N] ^ twist(s[i], s[i + 1]);
  s[N - 1] = s[M - 1] ^ twist(s[N - 1], s[0]);
}

static void temper(const uint32_t *s, uint32_t *out, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t y = s[i];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    out[i] = y;
  }
}

/* state: get_state() of torch's CPU generator (int32 left at byte 8, uint64 next at 16, uint64 words[624] at
   24), updated in place. out[i] = ((w0 & (2^21 - 1)) << 32 | w1) < threshold for the next two words w0, w1
   (random64() and uniform_real_distribution<double>: 53 bits), as bernoulli_distribution<double> draws. */
int slimact_bernoulli_u8(uint8_t *state, uint8_t *out, int64_t n, uint64_t threshold) {
  uint32_t s[N], w[N];
  int32_t left;
  uint64_t next;
  memcpy(&left, state + 8, 4);
  memcpy(&next, state + 16, 8);
  for (int i = 0; i < N; i++) {
    uint64_t word;
    memcpy(&word, state + 24 + 8 * i, 8);
    s[i] = (uint32_t)word;
  }
  /* words of the current block still unused (torch twists when --left reaches 0) and the next one's index */
  int64_t avail = (int64_t)left - 1, idx = (int64_t)next, o = 0;
  if (avail < 0 || next > N || idx + avail > N) return -1; /* not a state this kernel knows: nothing written */
  int carry = 0;
  uint32_t hi = 0;
  while (o < n) {
    if (avail == 0) {
      next_state(s);
      idx = 0;
      avail = N;
    }
    int64_t take = 2 * (n - o) - carry;
    if (take > avail) take = avail;
    temper(s + idx, w, take);
    int64_t k = 0;
    if (carry) { /* a pair split across two blocks */
      out[o++] = ((((uint64_t)(hi & 0x1fffffu)) << 32) | w[0]) < threshold;
      k = 1;
      carry = 0;
    }
    int64_t pairs = (take - k) / 2;
    uint8_t *dst = out + o;
    const uint32_t *src = w + k;
    for (int64_t j = 0; j < pairs; j++)
      dst[j] = ((((uint64_t)(src[2 * j] & 0x1fffffu)) << 32) | src[2 * j + 1]) < threshold;
    o += pairs;
    k += 2 * pairs;
    if (k < take) {
      hi = w[k];
      carry = 1;
    }
    idx += take;
    avail -= take;
  }
  if (n > 0) {
    for (int i = 0; i < N; i++) {
      uint64_t word = s[i];
      memcpy(state + 24 + 8 * i, &word, 8);
    }
    left = (int32_t)(N + 1 - idx);
    next = (uint64_t)idx;
    memcpy(state + 8, &left, 4);
    memcpy(state + 16, &next, 8);
  }
  return 0;
}
"""

_lock = threading.Lock()
_kernel: object = None  # None: not tried yet; False: not available; else the ctypes function


def _flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC"]
    if platform.machine() in ("x86_64", "AMD64"):
        with contextlib.suppress(OSError):
            if " avx2" in Path("/proc/cpuinfo").read_text():
                flags.append("-mavx2")
    return flags


def _cache_dir() -> Path:
    base = os.environ.get("SLIMACT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "slimact")
    return Path(base)


def _build() -> Path | None:
    """The kernel's shared library, compiled on first use (``None``: no compiler, or it failed)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    flags = _flags()
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags, platform.machine()]).encode()).hexdigest()[:16]
    user = getattr(os, "getuid", lambda: "user")()  # (no getuid on Windows)
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"slimact-{user}"):
        target = folder / f"bernoulli-{key}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                source = Path(tmp) / "bernoulli.c"
                source.write_text(_SOURCE)
                built = Path(tmp) / "bernoulli.so"
                subprocess.run([compiler, *flags, "-o", str(built), str(source)], check=True, capture_output=True,
                               timeout=120)
                os.replace(built, target)  # atomic: another process compiling the same file is harmless
            return target
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def _self_check(kernel) -> bool:
    """The kernel against ``bernoulli_`` from states before, at and after a twist, pairs split across blocks,
    odd lengths and the probabilities' edges: the masks and the generator states after them equal."""
    for skip in (0, 1, 311, 623, 624, 1001):
        for n, p in ((1, 0.5), (312, 0.9), (313, 0.1), (1000, 1.0 / 3), (5000, 0.0), (5000, 1.0)):
            ours, theirs = torch.Generator().manual_seed(skip), torch.Generator().manual_seed(skip)
            for g in (ours, theirs):
                if skip:
                    torch.empty(skip, dtype=torch.int32).random_(generator=g)
            expected = torch.empty(n, dtype=torch.uint8).bernoulli_(p, generator=theirs)
            got = _draw(kernel, torch.empty(n, dtype=torch.uint8), p, ours)
            if not (torch.equal(got, expected) and torch.equal(ours.get_state(), theirs.get_state())):
                return False
    return True


def _load():
    global _kernel
    with _lock:
        if _kernel is None:
            _kernel = False
            path = _build()
            if path is not None:
                try:
                    # PyDLL: the call keeps the GIL, so that no other Python thread draws from the generator
                    # between the state's read and its write back (bernoulli_ holds the generator's lock instead)
                    fn = ctypes.PyDLL(str(path)).slimact_bernoulli_u8
                except (OSError, AttributeError):
                    fn = None
                if fn is not None:
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
                    fn.restype = ctypes.c_int
                    if torch.Generator().get_state().numel() == _STATE_BYTES and _self_check(fn):
                        _kernel = fn
                    else:
                        warnings.warn("slimact: the CPU dropout mask kernel differs from this torch's bernoulli_; "
                                      "bernoulli_ is used", RuntimeWarning, stacklevel=3)
    return _kernel or None


def _draw(kernel, out: Tensor, p: float, generator: torch.Generator) -> Tensor:
    state = generator.get_state()  # a copy: [5056] uint8
    if kernel(state.data_ptr(), out.data_ptr(), out.numel(), math.ceil(math.ldexp(p, 53))) != 0:
        return out.bernoulli_(p, generator=generator)  # a state it does not know (nothing was written)
    generator.set_state(state)
    return out


def bernoulli_(out: Tensor, p: float, generator: torch.Generator | None = None) -> Tensor:
    """``out.bernoulli_(p, generator=generator)``: the same values, the same generator state after it; by the
    kernel (module docstring) for a contiguous uint8 CPU tensor of :data:`MIN_NUMEL` elements or more."""
    gen = torch.default_generator if generator is None else generator
    # (backend_for: a CPU tensor, and the fast paths not turned off by SLIMACT_BACKEND=reference)
    if not (backend_for(out) == "inductor" and out.dtype == torch.uint8 and out.numel() >= MIN_NUMEL
            and out.is_contiguous() and 0.0 <= p <= 1.0 and gen.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        return out.bernoulli_(p, generator=generator)
    kernel = _load()
    if kernel is None:
        return out.bernoulli_(p, generator=generator)
    return _draw(kernel, out, p, gen)
