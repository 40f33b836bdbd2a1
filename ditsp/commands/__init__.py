"""One module per CLI command, each with ``add_parser(subparsers)`` setting ``func(args, parser)``.

A new command is a new module here plus its name in :data:`COMMANDS`.
"""

COMMANDS = ("plan", "run", "upscale", "verify", "generate", "bench", "serve", "doctor", "train")
