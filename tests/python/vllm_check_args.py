"""Checks an engine command line with the pinned vLLM's own argument parser and validation,
without starting a server (no engine, no weights, no port): what `python -m
vllm.entrypoints.openai.api_server ARGS` does before it starts anything.

    python vllm_check_args.py [--build-config] MODEL [vLLM serve flags ...]
    python vllm_check_args.py --print-flags     # every option string `vllm serve` takes, one a line

1. make_arg_parser(FlexibleArgumentParser()).parse_args: an unknown flag or a bad value exits 2
   with argparse's message;
2. validate_parsed_serve_args: the server's cross-flag checks;
3. AsyncEngineArgs.from_cli_args: the engine arguments (JSON-valued flags such as
   --weight-transfer-config are parsed here);
4. with --build-config: create_engine_config(), which reads MODEL's config.json and validates the
   whole configuration for this machine.
Prints "ok" and exits 0 when vLLM accepts the command line; exits non-zero with vLLM's message
otherwise. Runs under the vLLM virtualenv (scripts/setup-vllm.sh).
"""
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main(argv):
    if argv == ["--print-flags"]:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        for flag in sorted({o for action in parser._actions for o in action.option_strings}):
            print(flag)
        return 0
    build = "--build-config" in argv
    argv = [a for a in argv if a != "--build-config"]
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(argv)  # exits 2 with the message on stderr
    try:
        validate_parsed_serve_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        if build:
            engine_args.create_engine_config()
    except Exception as e:  # noqa: BLE001 - vLLM's own message is the point
        print(f"vLLM rejects the command line: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
