"""A server on a pipeline layout (two stages, two rank processes, gloo on the CPU): ready only
after its warm-up went through both stages, every rank watching its own kernel compiles from
then on, and its greedy answer the one a single process gives."""

import httpx

from moeserve import LLM, SamplingParams
from moeserve.demo.random_model import ensure_random_model
from moeserve.server.wait_ready import EXIT_READY
from server_utils import ServerProcess

PROMPT = [5, 9, 3, 77, 12]


def test_a_two_stage_server_is_ready_through_both_stages_and_answers_as_one_process(tmp_path):
    model = str(ensure_random_model())
    srv = ServerProcess(model, tmp_path / "server.log", "--pipeline-parallel-size", "2", "--max-model-len", "256").start()
    try:
        r = srv.wait(timeout=180)
        assert r.code == EXIT_READY, f"{r.message}\n{srv.log()}"
        assert r.seen[-1] == "ready" and "loading" in r.seen, r.seen
        log = srv.log()
        assert "stage 0: layers [0, 2)" in log and "stage 1: layers [2, 4)" in log, log[-3000:]
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        served = resp.json()["choices"][0]["text"]
    finally:
        srv.stop()
    with LLM(model, device="cpu") as llm:
        expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    assert served == expected
