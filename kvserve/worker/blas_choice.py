"""Which BLAS library a captured CUDA graph records its matmuls with: each shape is captured with torch's
preferred library and with the other of cuBLAS and cuBLASLt, each capture's replay is timed, and the faster
graph is kept. The library is fixed when a matmul is recorded, so one graph can use cuBLASLt while another
uses cuBLAS, and eager steps keep torch's preference.

Neither library is best at every shape. On an H200 with the default model in float32, torch's choice for 2-16
rows of the 576-wide projections took 2-5x its 1-row time (o_proj 9.4 us at 2 rows against 2.7 at 1;
cuBLASLt 3.4), so a 2-token step cost 1.73 ms against 1.21 for 1 token (1.38 ms with cuBLASLt); but with
cuBLASLt everywhere, 32-sequence decode was 16% slower and 4 x 5-token verification took 2.55 ms against 2.19
(benchmarks/results/gpu_verify_step_k1*.md, speculative_gpu_decode_blas_*.md).

While a shape's candidates are timed, the graph pool holds each one's outputs; the loser's go back to the pool
for the shapes after it. For the largest shape that is one extra set of logits (rows x width x vocabulary
float32 values), taken from the headroom left after the KV pool, as the graphs' own memory is.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

CHOOSE_BLAS = True   # capture with both libraries and keep the faster (benchmarks turn it off to compare)
BLAS_MARGIN = 0.03   # the other library must be this much faster to replace the preferred one (replay noise)


def blas_candidates(preferred: str) -> list[str]:
    """The libraries a shape is captured with: torch's preference first, then the other of cuBLAS and
    cuBLASLt. On ROCm builds, and with CHOOSE_BLAS off, the preference alone."""
    if not CHOOSE_BLAS or torch.version.cuda is None:
        return [preferred]
    return [preferred, "cublas" if preferred == "cublaslt" else "cublaslt"]


def fastest(ms: list[float], margin: float = BLAS_MARGIN) -> int:
    """The index of the candidate to keep: the first (the preferred library) unless another's time is below
    its own by more than margin."""
    best = min(range(len(ms)), key=ms.__getitem__)
    return best if ms[best] < ms[0] * (1 - margin) else 0


@contextmanager
def preferred_blas(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` inside, restored after."""
    before = torch.backends.cuda.preferred_blas_library()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*preferred_blas_library.*")  # torch calls it experimental
        torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def usable_libraries(device: torch.device) -> list[str]:
    """The candidates for this process: torch's preference, and the other library where a small matmul runs
    with it preferred (a build without cuBLASLt keeps torch's choice, with a warning)."""
    preferred = torch.backends.cuda.preferred_blas_library().name.lower()
    usable = [preferred]
    for library in blas_candidates(preferred)[1:]:
        try:
            with preferred_blas(library):
                torch.ones(2, 64, device=device) @ torch.ones(64, 64, device=device)
                torch.cuda.synchronize(device)
            usable.append(library)
        except RuntimeError as e:
            logger.warning("CUDA graphs: %s is not usable here (%s); graphs keep torch's BLAS preference", library, e)
    return usable


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """GPU milliseconds per replay of a captured graph, over `replays` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def capture_fastest(forward: Callable[[], T], libraries: list[str], device: torch.device,
                    pool: tuple[int, int] | None) -> tuple[torch.cuda.CUDAGraph, T, str, dict[str, float]]:
    """forward() captured once per library (each warmed up outside the graph first: metadata, Triton's
    compiles, the library's kernel choice and workspace) into `pool`; (the faster graph, its outputs, its
    library, each candidate's replay ms: empty with one candidate). The replays that time them are the
    measurement, in alternating rounds, each candidate's best."""
    captured = []
    for library in libraries:
        with preferred_blas(library):
            forward()
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = forward()
        pool = graph.pool()
        captured.append((graph, outputs))
    keep, ms = 0, []
    if len(captured) > 1:
        ms = [float("inf")] * len(captured)
        for _ in range(3):
            for i, (graph, _) in enumerate(captured):
                ms[i] = min(ms[i], replay_ms(graph))
        keep = fastest(ms)
    graph, outputs = captured[keep]
    return graph, outputs, libraries[keep], dict(zip(libraries, ms))


def capture_all(keys: list[K], forward: Callable[[K], T], device: torch.device
                ) -> tuple[dict[K, torch.cuda.CUDAGraph], dict[K, T], dict[K, str], dict[K, dict[str, float]]]:
    """forward(key) captured for each key in the order given (largest first: a smaller graph's buffers fit
    in a larger's), all sharing one memory pool, each with the faster library (capture_fastest; a dropped
    candidate's memory goes back to the pool): the graphs, their outputs, their libraries and the candidates'
    replay times (kept so that a benchmark can show what each choice rested on), by key."""
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    outputs: dict[K, T] = {}
    blas: dict[K, str] = {}
    times: dict[K, dict[str, float]] = {}
    libraries = usable_libraries(device)
    pool = None
    for key in keys:
        graphs[key], outputs[key], blas[key], times[key] = capture_fastest(
            partial(forward, key), libraries, device, pool)
        pool = graphs[key].pool()
    torch.cuda.synchronize(device)
    return graphs, outputs, blas, times
