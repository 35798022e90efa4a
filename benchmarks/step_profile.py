"""Where one engine step's time goes: torch.profiler op tables (top ops by self CPU time) for decode
steps at batch 1 and 64 and for one 2048-token prefill step, on the default model in bf16.

    python benchmarks/step_profile.py        # writes results/step_profile.txt
"""
from __future__ import annotations

import io
import random
import time

from torch.profiler import ProfilerActivity, profile

from common import RESULTS, git_rev, machine_info
from kvserve import LLM, SamplingParams


def main() -> None:
    llm = LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048)
    eng = llm.engine
    rng = random.Random(0)
    out = io.StringIO()
    info = machine_info()
    print(f"# kvserve step profile (torch.profiler), git {git_rev()}, {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']}, {info['torch_threads']} threads, bf16\n", file=out)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def profiled(title: str, step, repeat: int) -> None:
        step()
        t0 = time.perf_counter()
        for _ in range(repeat):
            step()
        wall = (time.perf_counter() - t0) / repeat
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeat):
                step()
        print(f"== {title}: {wall * 1e3:.1f} ms/step without the profiler; table over {repeat} steps ==", file=out)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40),
              file=out)

    for batch in (1, 64):
        for i in range(batch):
            eng.add_request(f"d{batch}-{i}", prompt(rng.randint(32, 512)),
                            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        profiled(f"decode, batch {batch}, contexts 32-512 prompt tokens + generated", eng.step, 10)
        eng.abort_request([f"d{batch}-{i}" for i in range(batch)])

    def prefill_step() -> None:  # 8 prompts of 256 tokens: one full 2048-token step, then done (max_tokens=1)
        for _ in range(8):
            eng.add_request(f"p{rng.random()}", prompt(256), SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
    profiled("prefill, 8 x 256-token prompts in one step", prefill_step, 3)

    text = out.getvalue()
    print(text)
    (RESULTS / "step_profile.txt").write_text(text)
    print(f"wrote {RESULTS / 'step_profile.txt'}")


if __name__ == "__main__":
    main()
