"""The ``functional`` layer: config, workspace, forward, backward and the autograd Function."""
