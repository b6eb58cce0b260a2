"""Plug-ins the tests select by dotted path (``tests.plugins.<module>:<name>``), written
as a user would, from the public modules only."""
