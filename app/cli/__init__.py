"""The command line: ``refine``, ``make-checkpoint``, ``serve``, ``plan`` and the remote client commands."""
