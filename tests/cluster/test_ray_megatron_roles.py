"""Multi-turn rollout with a tool and ``reward_config``'s frozen reward model (in each replica's
leader) on the megatron backend (Ray worker groups, gloo) at TP 1 x DP 2: a model fine-tuned here
to answer every prompt with a tool call calls it on both backends, the tool's tokens are left out
of the loss, and the reward model's scores and the whole run equal the hf backend's in one
process. (PPO's critic saved in a directory of its own: test_ray_megatron.py's PPO test.)
"""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import is_wall_clock, same
from tests.cluster import test_ray_megatron
from tests.cluster.test_ray_megatron import RL, TRAIN
from tests.helpers import tools

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RAY_CPUS = 2
# metrics of float noise alone (the rollout's log-probs against the training forward's, fp32): the
# sharper the model (the tool caller below), the larger the log-probs and their rounding
NOISE = ("rollout/logprob_diff", "rollout/ratio")
model = test_ray_megatron.model  # the fixture: the cluster tests' model without a pad row


def assert_same_run(got, want) -> None:
    """The same generation batches, optimizer steps and logged metrics (wall clock aside)."""
    (want_batches, want_rows, want_steps), (got_batches, got_rows, got_steps) = want, got
    assert got_batches == want_batches and len(got_steps) == len(want_steps) > 0
    for step, (g, w) in enumerate(zip(got_steps, want_steps)):
        for key in (k for k in w if not is_wall_clock(k)):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (step, key)
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in got_rows] == [r["iteration"] for r in want_rows]
    for w, g in zip(want_rows, got_rows):
        for key in (k for k in w if not is_wall_clock(k) and not k.startswith("tool/")):
            if key.startswith(NOISE):  # the rollout's decoding against the training forward:
                assert abs(g[key] - w[key]) < 1e-3, (w["iteration"], key)  # fp32 noise on both backends
            else:
                assert same(g[key], w[key], key) or g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), \
                    (w["iteration"], key)


@pytest.fixture(scope="module")
def tool_caller(work, model):
    """``model`` fine-tuned to answer every prompt of the set with :data:`tools.CALL` (a few Adam
    steps on the prompts: the random model never writes a call)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.data.datasets import PromptDataset

    out = work / "tool_caller"
    if out.exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(model)
    call = tokenizer.encode(tools.CALL, add_special_tokens=False)
    prompts = [dataset["prompts"].tolist() for dataset in PromptDataset(work / "prompts/data")]
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.Adam(lm.parameters(), lr=5e-3)
    for _ in range(80):
        rows = [prompts[i] for i in torch.randint(len(prompts), (16,)).tolist()]
        width = max(len(r) for r in rows) + len(call)
        ids, labels = torch.zeros(len(rows), width, dtype=torch.long), torch.full((len(rows), width), -100)
        for b, row in enumerate(rows):  # right-padded; the loss on the call alone
            ids[b, :len(row) + len(call)] = torch.tensor(row + call)
            labels[b, len(row):len(row) + len(call)] = torch.tensor(call)
        mask = torch.arange(width) < torch.tensor([[len(r) + len(call)] for r in rows])
        loss = lm(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, loss.item()
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_multi_turn_and_a_reward_model_on_the_megatron_backend_equal_the_hf_backend(ray_cluster, work, tool_caller,
                                                                                   lowercase_rm_dir):
    """GRPO at TP 1 x DP 2 with tool calls and ``reward_config``'s reward model (one run for both,
    to spare CI a second pair): each replica's leader samples its share with the tool and scores it
    with the reward model. The same scores, call by call, and the same run as the hf backend; the
    tool's answer is in the responses and out of the loss."""
    from transformers import AutoTokenizer

    tools_file = work / "answer_tool.yaml"
    tools_file.write_text(tools.TOOLS_YAML)
    rl = {**RL, "multi_turn_enable": True, "async_engine": True, "tool_config_path": str(tools_file),
          "max_tool_calls": 1, "max_total_response_length": 112, "reward_model_weight": 0.5}
    sections = {"generate_config": {"max_model_len": 224, "max_num_seqs": 256, "infer_tensor_parallel_size": 1,
                                    "sampling_config": {"max_tokens": 56, "temperature": 1.0, "top_k": -1,
                                                        "top_p": 1.0}},
                "reward_config": {"load": str(lowercase_rm_dir), "micro_batch_size": 4}}
    runs, scores, batches = {}, {"hf": [], "megatron": []}, []
    for name, workers, extra in (("hf", 1, {}), ("megatron", 2, {"backend": "megatron"})):
        runs[name] = record_run(grpo_config(work, f"mg_multi_turn_rm_{name}", workers=workers, iters=1, rl=rl,
                                            sections=sections,
                                            train={**TRAIN, **extra, "seq_length": 224,
                                                   "tokenizer_name_or_path": str(tool_caller)}),
                                reward_model_scores=scores[name], update_batches=batches if name == "megatron" else None)
    assert len(scores["megatron"]) == len(scores["hf"]) > 0
    for got, want in zip(scores["megatron"], scores["hf"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert max(max(s) for s in scores["hf"]) > min(min(s) for s in scores["hf"])
    assert_same_run(runs["megatron"], runs["hf"])
    rows = [r for r in runs["megatron"][1] if "actor/pg_loss" in r]
    assert "reward_model/score/mean" in rows[0]
    assert rows[0]["tool_call_num/mean"] > 0.5, rows[0]  # (tool/* counters stay in the Ray workers)
    # the tool's answer inside the responses, out of the loss: a 0 of the mask between 1s
    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    masked = 0
    for batch in batches:
        width = batch["response_mask"].shape[1]  # the responses: the last columns of input_ids
        for response, mask in zip(batch["input_ids"][:, -width:], batch["response_mask"]):
            ones = mask.nonzero().flatten()
            gap = [t for i, t in enumerate(response.tolist()) if ones[0] < i < ones[-1] and mask[i] == 0]
            if gap:
                assert "ok" in tokenizer.decode(gap) and "</tool_call>" in tokenizer.decode(response[:ones[-1]])
                masked += 1
    assert masked > 0
