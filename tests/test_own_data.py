"""``grpo-kernels train --data rows.jsonl --reward module:function --model folder``: a tiny local model trained on a
generated JSONL with a reward function written for TRL (its signature, its column by name), evaluated on held-out
rows; chat prompts rendered by the tokenizer's template and handed to the reward as TRL hands them; and each
mistake named: a row without a prompt, a reward that cannot be imported, a prompt longer than the model's context."""

import ast
import json
import subprocess
import sys

import pytest

from grpo_kernels.training.data import load_reward_function, read_rows, trainer_rows, trl_signature
from grpo_kernels.training.tasks import compare

# a reward function as a TRL user writes one: keyword arguments, the dataset's column by name
TRL_REWARD = """
def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def seen(prompts, completions, **kwargs):
    with open(__file__ + ".calls", "a") as f:
        f.write(repr((prompts[0], completions[0], sorted(kwargs))) + "\\n")
    return [0.0] * len(completions)
"""


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tokenizer = compare.build_tokenizer()
    compare.build_model(tokenizer, hidden_size=32, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_train_on_your_own_jsonl_with_a_trl_reward(model_dir, tmp_path):
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in compare.make_rows(40, held_out=False, seed=0)]
    train = _jsonl(tmp_path / "train.jsonl", rows[:32])
    held_out = _jsonl(tmp_path / "eval.jsonl", rows[32:])
    (tmp_path / "my_rewards.py").write_text(TRL_REWARD)
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "grpo_kernels",
        "train",
        "--model",
        str(model_dir),
        "--data",
        str(train),
        "--eval-data",
        str(held_out),
        "--reward",
        "my_rewards:correct",
        "--reward",
        "my_rewards:seen",
        "--reward-weights",
        "1.0",
        "0.5",
        "--steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--eval-every",
        "2",
        "--save-every",
        "0",
        "--no-progress",
        "--output-dir",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]
    calls = (tmp_path / "my_rewards.py.calls").read_text().splitlines()
    prompt, completion, columns = ast.literal_eval(calls[0])
    assert prompt in {r["prompt"] for r in rows} and isinstance(completion, str) and columns == ["answer"]
    assert (out / "checkpoint-2" / "model.safetensors").exists()


def test_chat_prompts_are_rendered_and_handed_to_the_reward_as_trl_does(tmp_path):
    tokenizer = compare.build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    messages = [{"role": "user", "content": "9.11 or 9.9?"}]
    (row,) = trainer_rows([{"prompt": messages, "answer": "9.9"}], tokenizer, 64, 8, "--data")
    assert row["prompt"] == "9.11 or 9.9?>" and row["answer"] == "9.9"
    seen = []

    def trl_reward(prompts, completions, answer, **kwargs):
        seen.append((prompts, completions, answer))
        return [1.0] * len(completions)

    reward = trl_signature(trl_reward)
    assert reward([row["prompt"]], ["9.9"], answer=[row["answer"]], prompt_as_given=[messages]) == [1.0]
    assert seen == [([messages], [[{"role": "assistant", "content": "9.9"}]], ["9.9"])]


def test_mistakes_in_your_data_and_rewards_are_named(model_dir, tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(ValueError, match=r'line 2: each row needs a "prompt" .*got \[\'question\'\]'):
        read_rows(str(bad))
    with pytest.raises(ValueError, match=r"--reward 'nowhere:f': cannot import nowhere \(ModuleNotFoundError"):
        load_reward_function("nowhere:f")
    (tmp_path / "rewards_file.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"has no function 'missing'"):
        load_reward_function(f"{tmp_path / 'rewards_file.py'}:missing")
    tokenizer = compare.build_tokenizer()
    with pytest.raises(
        ValueError,
        match=r"--data row 2: its prompt is 40 tokens, which with --max-new-tokens 8 "
        r"exceeds the model's context of 32 positions",
    ):
        trainer_rows([{"prompt": "1.5"}, {"prompt": "9" * 40}], tokenizer, 32, 8, "--data")
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        trainer_rows([{"prompt": [{"role": "user", "content": "hi"}]}], tokenizer, 64, 8, "--data")
    from grpo_kernels.training import cli

    args = cli.build_parser().parse_args(["train", "--data", str(bad), "--reward", "m:f"])
    with pytest.raises(ValueError, match="--data needs --model"):
        cli._check_data_options(args)
