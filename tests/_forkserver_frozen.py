"""Imported last by the test forkserver (``tests/_forkserver.PRELOAD``): ``gc.freeze()`` moves every object the
preloaded imports made into the permanent generation, so a forked rank's garbage collections never walk them (nor
write their headers, copying the server's pages into each rank)."""

import gc

gc.freeze()
