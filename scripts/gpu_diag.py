"""Find the failing op of a 1024-token prefill after graph capture (run with CUDA_LAUNCH_BLOCKING=1)."""
import sys
import traceback

import torch

from moeserve import LLM, SamplingParams

eager = sys.argv[1] == "eager"
common = dict(load_format="dummy", dtype="bfloat16", device="cuda", seed=0, gpu_memory_utilization=0.85,
              max_model_len=1344, max_num_seqs=64, max_num_batched_tokens=16384, enforce_eager=eager)
G = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
with LLM("moonlight-16b-a3b", **common) as llm:
    for n in (3, 200, 600, 1024):
        p = torch.randint(0, 163840, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        try:
            print(n, llm.generate([p], G)[0].outputs[0].token_ids, flush=True)
        except Exception:
            traceback.print_exc()
            break
