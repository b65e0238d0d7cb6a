"""`vllm serve MODEL [flags...]` for the vLLM CPU wheel, whose `vllm` console script does not start
(it looks up a distribution named `vllm`): runs the same OpenAI API server module with the model
as `--model`. The cluster end-to-end test maps the engine container's `vllm` command to this
(docs/vllm.md); the arguments are the operator's, unmodified.

    python vllm_serve.py serve MODEL [vLLM serve flags ...]
"""
import runpy
import sys


def main():
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "serve":
        raise SystemExit("usage: vllm_serve.py serve MODEL [flags ...]")
    sys.argv = ["vllm.entrypoints.openai.api_server", "--model", args[1], *args[2:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
