"""`raylane generate`: offline generation from a local checkpoint, for a quick look at a model."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded demo Llama)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of a chat")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")


def run(args: argparse.Namespace) -> int:
    from raylane.engine import LLM, SamplingParams
    from raylane.models.demo import create_demo_models, default_demo_dir

    model = args.model or str(create_demo_models(default_demo_dir())["raylane-llama-tiny"])
    llm = LLM(model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        completion = out.outputs[0]
        print(f"--- {prompt!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
        print(completion.text)
    return 0
