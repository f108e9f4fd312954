"""One module per CLI verb: each defines ``add_arguments(parser)`` and
``run(args) -> int``; heavy imports stay inside ``run`` so ``--help`` is fast."""
