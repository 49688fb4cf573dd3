"""Entry points at the top of the import graph: the command line (:mod:`.cli`), the demo
(:mod:`.demo`) and the bench (:mod:`.bench`). They use the sender and the receivers; nothing
below imports them."""
