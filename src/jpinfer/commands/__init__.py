"""The subcommands of ``jpinfer`` (``jpinfer.cli``), one module each with ``add_arguments(parser, command)``
and ``run(args) -> int``: the command line is glue over the stages and ``jpinfer.api``, so it sits above
them all and no stage imports it. ``args`` holds the options several commands share.

Nothing is imported here: ``jpinfer.cli`` imports only the invoked command's module.
"""
