"""The pool replica process: the `ModelPool` deployment and its OpenAI serving classes (chat,
completions, Responses, tokenization) on one engine, with their chat templates, reasoning and
tool-call output parsing, and the pool's autoscaling policy."""
