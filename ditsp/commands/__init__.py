"""One module per CLI command, each with ``add_parser(subparsers)`` setting ``func(args, parser)``.

A new command is a new module here plus its name in :data:`COMMANDS`.

Imports inside functions are the rule in this package (and in ``ditsp.bench``): ``ditsp`` builds every
command's parser at start, so a command module imports only what its parser needs and reads the
models, the launcher and the I/O stack when its ``main`` runs (``ditsp --help`` stays fast).
"""

COMMANDS = ("plan", "run", "upscale", "verify", "generate", "bench", "serve", "doctor", "train", "rl")
