"""The ground floor: which device a run uses, what it can compute fast, how to wait for it, its peaks and memory."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import resource
import time
from pathlib import Path

import torch

from vitrain.errors import ConfigError

# Dense (no sparsity) peak FLOP/s per GPU from NVIDIA's datasheets, by a substring of the device name.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}
BF16_UNITS_ENV = "VITRAIN_CPU_BF16_UNITS"
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the config's names of the low-precision dtypes
DTYPES = {"fp32": torch.float32, **LOW_DTYPES}


def resolve_device(name: str) -> torch.device:
    """train.device: auto is cuda where there is one, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device={name} is not a device; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=auto or cpu")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer read after it measures the work (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_has_bf16_matmul_units() -> bool:
    """Whether this CPU has bf16 matrix units (Intel AMX tiles): with them auto picks bf16 amp_o1 on CPU, else fp32.

    `VITRAIN_CPU_BF16_UNITS=1` or `=0` in the environment forces the answer, so that both of auto's CPU choices can
    be tested (and a run reproduced) on any machine; unset, torch's AMX probe decides.
    """
    forced = os.environ.get(BF16_UNITS_ENV)
    if forced is None:
        return amx_probe()
    if forced not in ("0", "1"):
        raise ConfigError(
            f"{BF16_UNITS_ENV}={forced!r} must be 1 (bf16 matrix units) or 0 (none), or unset to probe the CPU"
        )
    return forced == "1"


def amx_probe() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


# Environment variables that cap the instruction set ATen, oneDNN and MKL use (cpu_description names them).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu_description() -> str:
    """One line naming the CPU and its bf16 capabilities, e.g. for CI logs where results depend on auto's choice."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    vendor = f" ({fields['vendor_id']})" if fields.get("vendor_id") else ""
    if fields.get("cpu family") and fields.get("model"):  # "AMD EPYC" alone names several generations
        vendor += f" family {fields['cpu family']} model {fields['model']}"
    units = "yes" if cpu_has_bf16_matmul_units() else "no"
    if BF16_UNITS_ENV in os.environ:
        probe = "yes" if amx_probe() else "no"
        units += f" (forced by {BF16_UNITS_ENV}={os.environ[BF16_UNITS_ENV]}; the probe says {probe})"
    avx = "yes" if torch.cpu._is_avx512_bf16_supported() else "no"
    # The flags above are the CPU's; these variables make ATen, oneDNN and MKL use less of it (the way to emulate an
    # AVX2 CPU on a newer one): its figures and autotune's decisions are another machine's.
    capped = ", ".join(f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name))
    capped = f"; instruction set capped: {capped}" if capped else ""
    return f"CPU: {model}{vendor}; bf16 matrix units (AMX): {units}; avx512_bf16: {avx}{capped}"


def key_compiled_cpu_kernels(device_type: str) -> None:
    """Before torch.compile on a CPU: make inductor's cache tell vector instruction sets apart. Its FX graph cache
    key holds inductor's config but not the instruction set it generated C++ for (torch 2.13), so a graph generated
    for AVX-512 and loaded where ATEN_CPU_CAPABILITY=avx2 (or on an AVX2 host sharing the cache folder) is built
    for AVX2 and computes NaNs, and the other way round writes past its buffers (glibc aborts). Setting cpp.simdlen
    to the width inductor picks anyway generates the same code and puts the width in the key. A simdlen set by the
    user is kept; a no-op off the CPU."""
    if device_type != "cpu":
        return
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.simdlen is None:
        picked = pick_vec_isa()
        config.cpp.simdlen = picked.bit_width()
        # Pinned, inductor takes the first instruction set of that width. In torch 2.13 that is always the one it
        # picked (one x86 set of each width is in its list, AMX and AVX-512 VNNI before plain AVX-512); where a torch
        # lists another first, the config stays as it was and the code as it would be.
        if pick_vec_isa() != picked:
            config.cpp.simdlen = None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's description line."""
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    return cpu_description()


def gemm_flops(dtype: str, device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a size x size x size matmul in `dtype` (best of `repeats` after a warm-up), with this
    process's threads: the practical peak that a model's FLOP/s is compared with on a CPU."""
    return gemm_flops_taking_turns((dtype,), device, size, repeats)[dtype]


def gemm_flops_taking_turns(dtypes: tuple[str, ...], device: torch.device, size: int, repeats: int) -> dict[str, float]:
    """gemm_flops for each of `dtypes`, one call of each per round (best of `repeats` rounds after a warm-up one):
    a busy moment of the machine then slows one round's calls alike, not every call of one dtype."""
    draw = torch.Generator(device).manual_seed(0)
    operands = {}
    for dtype in dtypes:
        a, b = (torch.randn(size, size, device=device, generator=draw).to(DTYPES[dtype]) for _ in range(2))
        operands[dtype] = a, b
    best = dict.fromkeys(dtypes, float("inf"))
    for i in range(repeats + 1):
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.mm(a, b)
            synchronize(device)
            if i:  # the first round is the warm-up
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return {dtype: 2 * size**3 / seconds for dtype, seconds in best.items()}


BF16_SLOWER_LIMIT = 3.0  # a bf16 matmul over 3x slower than an fp32 one: bf16 is emulated here (bf16_emulated)
PROBE_SIZE = 512  # the matmul that compares the two dtypes: milliseconds where bf16 is fast, under a second where not


def bf16_emulated(device: torch.device) -> str | None:
    """Why bf16 is not worth running on this CPU, or None where it may be. A CPU without bf16 instructions (an AVX2
    Zen 3) computes bf16 matmuls in software: autotune's race measured its bf16 steps ~17x slower than fp32's. A
    step whose matmuls are over BF16_SLOWER_LIMIT x slower cannot win a GEMM-bound step back on its halved
    elementwise traffic. Measured (PROBE_SIZE^3 matmuls, the two dtypes taking turns), not read from CPU flags:
    some CPUs without AMX run bf16 faster than fp32, others slower. Autotune and the peers' benchmark skip bf16
    where it says so."""
    if device.type != "cpu":
        return None
    # Taking turns, best of 5: on a machine busy with other processes (a test suite's workers), calls of one dtype
    # slowed by the others' time slices read bf16 as emulated where it is not.
    flops = gemm_flops_taking_turns(("fp32", "bf16"), device, PROBE_SIZE, repeats=5)
    fp32, bf16 = flops["fp32"], flops["bf16"]
    if bf16 * BF16_SLOWER_LIMIT >= fp32:
        return None
    return (
        f"a {PROBE_SIZE}^3 bf16 matmul ran at {bf16 / 1e9:.1f} GFLOP/s against fp32's {fp32 / 1e9:.1f} "
        f"here, {fp32 / bf16:.0f}x slower (bf16 emulated)"
    )


@functools.cache
def bf16_emulated_here(device_type: str) -> str | None:
    """bf16_emulated for this process's device kind, measured once per process: every engine of a run resolving its
    precision, a bf16 GEMM peak, the peers' table. Autotune measures at its race instead (rank 0's, broadcast)."""
    return bf16_emulated(torch.device(device_type))


def peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = dtype
        if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            key = "tf32"
        for known, peaks in GPU_PEAKS.items():
            if known in name and key in peaks:
                return peaks[key], f"{name} datasheet dense {key}"
        measured = gemm_flops(dtype, device, size=8192)
        return measured, f"{name}: 8192^3 {dtype} matmul measured (not in the datasheet table)"
    threads = torch.get_num_threads()
    if dtype == "bf16" and bf16_emulated_here(device.type):
        return gemm_flops(dtype, device, size=PROBE_SIZE), (
            f"{PROBE_SIZE}^3 bf16 matmul measured on this CPU with {threads} thread(s) (bf16 emulated here)"
        )
    return gemm_flops(dtype, device), f"2048^3 {dtype} matmul measured on this CPU with {threads} thread(s)"


def cpu_gemm_peaks(device: torch.device) -> tuple[dict[str, float], str | None]:
    """({"fp32": FLOP/s, "bf16": FLOP/s} of this process's threads on a CPU, bf16_emulated's reason or None).

    Each is peak_flops': a 2048^3 matmul's, but bf16's is a PROBE_SIZE^3 one where bf16 is emulated: in software
    the 2048^3 product takes tens of seconds a call (a ladder's start capped at AVX2: 6 minutes), and a bf16 MFU means
    nothing there."""
    return {dtype: peak_flops(device, dtype)[0] for dtype in ("fp32", "bf16")}, bf16_emulated_here(device.type)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(peak bytes so far, what they are): the CUDA allocator's peak on a GPU, the process's peak RSS on a CPU
    (since `reset_peak_memory` where that could reset it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocator peak"
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def reset_peak_memory(device: torch.device) -> bool:
    """Start the peak over from what is held now (so a benchmark's peak is its steps', not the set-up's or
    autotune's before them): the CUDA allocator's statistics, or on Linux the process's RSS high-water mark
    (`/proc/self/clear_refs`, which ru_maxrss follows). False where it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # 5: reset the peak RSS to the current RSS (proc(5))
    except OSError:
        return False
    return True


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (a GPU's free bytes, a CPU host's MemAvailable), or None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PhaseTimer:
    """Seconds per named phase of a step, each lap ending where the device has finished the phase's work.

    The benchmark hands one to the step (vitrain/engine/step.py), which marks its phases; training passes none, so
    the step it runs has no synchronization added.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def start(self) -> None:
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


@functools.cache
def glibc_function(name: str):
    """A glibc function (malloc_trim, mallopt) from the symbols the process already has (no library search, looked
    up on first use), or None on another C library (macOS, musl), whose allocators have their own policy."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):  # TypeError: Windows, where CDLL needs a library name
        return None


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the OS (glibc's malloc_trim(0)); a no-op elsewhere."""
    trim = glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def reuse_freed_host_memory() -> bool:
    """glibc: serve every allocation from the heap and keep freed memory there (mallopt M_MMAP_MAX=0 and a 2 GiB
    M_TRIM_THRESHOLD), so that a step's large activations reuse pages instead of being mapped, zeroed by page
    faults and unmapped again in every step (glibc maps blocks over 32 MiB afresh each time). ViT-S/16 at 224 px,
    batch 64, bf16 on a 2-core Zen 4: 1.08x (1.05-1.35) images/s (docs/performance.md). Memory freed stays with the
    process until malloc_trim (the streaming loader trims). False where the C library is not glibc."""
    mallopt = glibc_function("mallopt")
    if mallopt is None:
        return False
    # mallopt takes a C int: the largest trim threshold it can be given is 2 GiB.
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
