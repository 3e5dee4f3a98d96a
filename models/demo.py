"""`raylane demo-models DIR`: write the small random-weight checkpoints that demos, tests and benches serve.

Both are real Hugging Face checkpoints (config.json, float32 safetensors, tokenizer, generation config),
so everything that loads a published model loads these: a dense Llama with grouped-query attention and
a Qwen3-MoE with 8 experts. Weights come from a fixed seed, so every run writes the same model.
"""

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from raylane.config import DEMO_MODELS

if TYPE_CHECKING:  # torch and transformers load inside functions: the CLI imports this module for --help
    from tqdm import tqdm
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

ASSETS = Path(__file__).parent / "assets"
LLAMA, QWEN3_MOE = DEMO_MODELS  # the names pools may ask for (`model: demo:<name>`)
SEED = 0
# Far above the usual 0.02: random logits then spread wide enough that greedy argmax is rarely a
# near-tie, so an engine's float32 output can be compared token for token with Hugging Face's.
INITIALIZER_RANGE = 0.15
MAX_POSITIONS = 2048


def default_demo_dir() -> Path:
    return Path(os.environ.get("RAYLANE_DEMO_DIR", "~/.cache/raylane/demo-models")).expanduser()


def load_tokenizer() -> "PreTrainedTokenizerFast":
    """The shipped BPE tokenizer (see `raylane.cluster.train_tokenizer`) with ChatML special tokens and
    template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS / "tokenizer.json"),
        eos_token="<|im_end|>",  # ends an assistant turn, so generation stops there
        pad_token="<|endoftext|>",
        chat_template=(ASSETS / "chat_template.jinja").read_text(),
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,  # would change text (" ," -> ","), breaking round trips
    )


def model_config(name: str, tokenizer: "PreTrainedTokenizerFast") -> "PretrainedConfig":
    from transformers import LlamaConfig, Qwen3MoeConfig

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded like published models (TP shards evenly)
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,  # GQA: two query heads share each KV head
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=None,
        eos_token_id=im_end,
        # No pad_token_id here: it would make it the embedding's padding_idx, initialized to a zero row.
        dtype="float32",
    )
    if name == LLAMA:
        return LlamaConfig(
            **common,
            intermediate_size=688,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
    if name == QWEN3_MOE:
        return Qwen3MoeConfig(
            **common,
            intermediate_size=688,  # unused while every layer is sparse (mlp_only_layers=[])
            moe_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,  # as Qwen3-30B-A3B: the top-k routing weights sum to 1
            tie_word_embeddings=False,  # a separate lm_head, unlike the Llama, so both load paths get used
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    raise ValueError(f"unknown demo model {name!r}")


def build_model(name: str, tokenizer: "PreTrainedTokenizerFast") -> "PreTrainedModel":
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = model_config(name, tokenizer)
    # A fixed seed per model, not per run: creating one model alone gives the same weights as creating
    # both, and the caller's RNG state is left as it was.
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    eot = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, eot],  # stop at the end of a turn or of a text
        pad_token_id=eot,
    )
    return model


def is_complete(path: Path) -> bool:
    # Models are renamed into place only once fully written, so a config means a whole checkpoint.
    return (path / "config.json").is_file()


def write_model(
    name: str, tokenizer: "PreTrainedTokenizerFast", path: Path, force: bool, bar: "tqdm"
) -> None:
    """Build and save one model, advancing the progress bar `bar` by three steps."""
    bar.set_postfix_str(f"{name}: init weights")
    model = build_model(name, tokenizer)
    bar.update()
    # Write next to the target and rename, so an interrupted run never leaves a half model that a
    # later run would take for a complete one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=path.parent))
    try:
        bar.set_postfix_str(f"{name}: save weights")
        model.save_pretrained(tmp)
        bar.update()
        bar.set_postfix_str(f"{name}: save tokenizer")
        tokenizer.save_pretrained(tmp)
        bar.update()
        # mkdtemp and transformers create owner-only files; other users (a Ray worker, a pod mounting
        # the folder) should be able to read a public demo model.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        # Another process (a second test worker, a second replica) may have finished the same model
        # meanwhile; it may already be loading it, so keep its copy rather than delete it underneath.
        if not force and is_complete(path):
            return
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def create_demo_models(
    out_dir: str | Path, force: bool = False, names: Iterable[str] = DEMO_MODELS
) -> dict[str, Path]:
    """Write each demo model to `out_dir/<name>`, skipping complete ones unless `force`; return the paths."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    out_dir = Path(out_dir).expanduser()
    paths = {name: out_dir / name for name in names}
    if unknown := set(paths) - set(DEMO_MODELS):
        raise ValueError(f"unknown demo models {sorted(unknown)}; choose from {', '.join(DEMO_MODELS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [name for name, path in paths.items() if force or not is_complete(path)]
    if not todo:
        return paths
    tokenizer = load_tokenizer()
    hf_progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' own "Writing model shards" bar would nest in ours
    try:
        with tqdm(total=3 * len(todo), desc="demo models", unit="step") as bar:
            for name in todo:
                write_model(name, tokenizer, paths[name], force, bar)
    finally:
        if hf_progress_bars:
            hf_logging.enable_progress_bar()
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "out_dir",
        nargs="?",
        type=Path,
        default=default_demo_dir(),
        help="folder to write the models into (default: %(default)s, from $RAYLANE_DEMO_DIR if set)",
    )
    parser.add_argument("--force", action="store_true", help="rewrite models that already exist")


def run(args: argparse.Namespace) -> int:
    existed = set() if args.force else {name for name in DEMO_MODELS if is_complete(args.out_dir / name)}
    for name, path in create_demo_models(args.out_dir, force=args.force).items():
        size_mib = sum(f.stat().st_size for f in path.iterdir()) / 2**20
        print(f"{'kept' if name in existed else 'wrote'} {name}: {path} ({size_mib:.1f} MiB)")
    return 0
