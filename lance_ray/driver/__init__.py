"""The driver side of a run: the handle that creates a coordinator and the views attached
to it (``Coordinator``), above the views it builds."""
