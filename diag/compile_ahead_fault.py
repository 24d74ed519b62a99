"""Which kernel of compile-ahead faults (CUDA_LAUNCH_BLOCKING=1): one case per process."""
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch  # noqa: E402

import moeserve.engine.compile_ahead as ca  # noqa: E402
import moeserve.kernels.mla_decode as md  # noqa: E402
from moeserve.kernels import logit_filter, sampling  # noqa: E402


def traced(mod, name):
    f = getattr(mod, name)

    def g(*a, **k):
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in a[:8]]
        print(f"-> {name} {shapes} {k}", flush=True)
        try:
            out = f(*a, **k)
            torch.cuda.synchronize()
            return out
        except Exception:
            traceback.print_exc()
            print(f"FAULT in {name}", flush=True)
            os._exit(3)

    setattr(mod, name, g)


traced(md, "mla_decode")
traced(ca, "compile_prefix_attention")
traced(sampling, "compile_variants")
traced(logit_filter, "compile_variants")
import moeserve.engine.model_runner as mr  # noqa: E402

traced(mr, "compile_step_sized_variants")

case = sys.argv[1]
from moeserve import LLM  # noqa: E402

if case.startswith("random"):
    from spec_checkpoints import make_mtp_checkpoint, write_random_draft

    tmp = Path(tempfile.mkdtemp())
    path = str(make_mtp_checkpoint(tmp / "t")[0])
    kw = dict(device="cuda", dtype="float32", backend="triton", max_num_batched_tokens=16, page_size=16, max_num_seqs=4, max_model_len=64)
    if case == "random_eagle3":
        kw["speculative_config"] = {"method": "eagle3", "model": write_random_draft(tmp / "d"), "num_speculative_tokens": 2}
    if case == "random_mtp":
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(path, **kw)
else:
    llm = LLM("deepseek-v3", load_format="dummy", hf_overrides={"num_hidden_layers": 5})
print("BUILT OK", case, flush=True)
