"""`bench peers`' workload: the same model and tokens on both sides, a GRPO step of each."""

import os

import jax
import numpy as np
import pytest
import torch

from espo_jax import host_memory
from espo_jax.bench import peer_process, peers, rl_step, trl_peer
from espo_jax.models import forward, hf_io
from espo_jax.models.flops import param_count


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("peers_model"))
    peers.save_workload_model(path)
    return path


def test_tokenizer_one_id_per_character_and_an_end_the_model_cannot_emit():
    tok = peers.char_tokenizer()
    text = peers.prompt_texts(1)[0]
    ids = tok.encode(text)
    assert len(ids) == peers.PROMPT_LEN and max(ids) < 64
    assert tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == 64


def test_the_workload_model_is_the_issue_s_and_espo_reads_it_exactly(workload):
    from transformers import AutoModelForCausalLM

    config, params = hf_io.from_pretrained(workload)
    # embed + head 2 * 64 * 128; per layer: q/o 128 * 128, k/v 128 * 64, q/k norms 2 * 32,
    # two norms 2 * 128, router 128 * 8, experts 8 * 3 * 128 * 256; final norm 128.
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 64 + 256 + 1024 + 8 * 3 * 128 * 256
    assert param_count(config) == 2 * 64 * 128 + 4 * per_layer + 128 == 3_364_224
    tokens = np.random.default_rng(0).integers(0, 64, (2, 20))
    ours = np.asarray(forward(config, params, tokens).logits)
    model = AutoModelForCausalLM.from_pretrained(workload, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_a_grpo_step_on_each_side(workload, tmp_path):
    config, params = hf_io.from_pretrained(workload)
    tok = peers.char_tokenizer()
    texts = peers.prompt_texts(peers.PROMPTS)
    espo = rl_step.EspoStep(peers.grpo_config(), config, jax.tree.map(np.asarray, params),
                            [tok.encode(t) for t in texts],
                            lambda i, tokens: trl_peer.even_fraction(tokens))
    before = jax.tree.map(np.array, espo.state.params)  # copies: the step donates
    espo.step()
    # 64 responses of exactly 32 tokens (no stop token); the reward is their even-id share.
    assert 0.3 < espo.last["reward_mean"] < 0.7
    moved = [float(np.max(np.abs(a - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(espo.state.params),
                             strict=True)]
    assert max(moved) > 0
    between = []  # the benchmark alternates: an espo_jax step after each TRL step
    seconds, info = trl_peer.trl_grpo_seconds(
        workload, texts, 1, str(tmp_path / "trl"), peers.LEARNING_RATE, peers.NEW_TOKENS,
        peers.SAMPLES, between=between.append)
    assert len(seconds) == 1 and seconds[0] > 0 and info["trl_threads"] >= 1
    assert between == seconds
    # the step's parts, timed around the reward call, make up the step; every response has
    # the whole budget on both sides (the eos id is outside the model's vocabulary)
    (part,) = info["parts"]
    assert (part["completion_tokens"] == espo.last["completion_tokens"]
            == peers.PROMPTS * peers.SAMPLES * peers.NEW_TOKENS)
    assert min(part[k] for k in rl_step.PARTS) > 0
    assert sum(part[k] for k in rl_step.PARTS) == pytest.approx(seconds[0], rel=1e-6)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x]
    return dict(pairs)


def test_the_peers_run_in_their_own_process_under_glibc_defaults(workload, tmp_path):
    """bench peers' child: started without the huge-page tunable (other tunables kept), it
    answers each request in turn, runs TRL one step at a time (the parent's step between),
    and a failing request surfaces as an error naming the child's exception."""
    tok = peers.char_tokenizer()
    gen_prompts = [tok.encode(t) for t in peers.prompt_texts(4, seed=1)]
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=4"}
    with peer_process.PeerProcess(host_memory.without_huge_pages(env)) as peer:
        info = peer.request("load", model_dir=workload, gen_prompts=gen_prompts, gen_new=5,
                            train_tokens=tokens.tolist(), lr=1e-5)
        # read once it has answered: before its exec a fresh child shows its parent's environment
        if os.path.exists(f"/proc/{peer._proc.pid}/environ"):
            child = _environ(peer._proc.pid)
            assert child["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4"
            assert child[host_memory.OFF_SWITCH] == "0"
        # the torch step's first loss: next-token cross-entropy of a random model over 64
        # symbols (ln 64 = 4.16) plus the router aux loss (~0.001 * k = 0.002)
        assert abs(info["loss0"] - np.log(64)) < 0.1 and info["torch_threads"] >= 1
        assert peer.request("generate") == {"ok": True} == peer.request("train")
        between = []
        trl = peer.trl(lambda: between.append(1), model_dir=workload,
                       prompts=peers.prompt_texts(2), steps=2, out_dir=str(tmp_path / "trl"),
                       lr=1e-5, new_tokens=4, samples=2)
        assert len(trl["seconds"]) == 2 and min(trl["seconds"]) > 0 and between == [1, 1]
        with pytest.raises(RuntimeError, match="unknown request 'nonsense'"):
            peer.request("nonsense")
        assert peer._proc.wait(timeout=30) == 1
        with pytest.raises(RuntimeError, match=r"peer process ended \(status 1\)"):
            peer.request("generate")  # a child that has exited: the same clear error


def test_sides_alternate_in_turns_of_back_to_back_repeats():
    from espo_jax.bench.model import interleaved_medians

    calls = []
    medians = interleaved_medians({"a": lambda: calls.append("a"),
                                   "b": lambda: calls.append("b")}, repeats=6, block=3)
    assert "".join(calls) == "aaabbbaaabbb" and set(medians) == {"a", "b"}
    with pytest.raises(ValueError, match="repeats 5 is not a multiple of block 3"):
        interleaved_medians({"a": lambda: None}, repeats=5, block=3)


def test_cpu_times_reads_busy_idle_and_steal(tmp_path):
    from espo_jax.bench import cpu_times

    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
    stat.write_text(f"cpu  {3 * hz} 0 {hz} {10 * hz} {hz} 0 0 {2 * hz} 0 0\ncpu0 1 2 3\n")
    assert cpu_times(str(stat)) == {"busy_s": 4.0, "idle_s": 11.0, "steal_s": 2.0}
    assert cpu_times(str(tmp_path / "missing")) is None
