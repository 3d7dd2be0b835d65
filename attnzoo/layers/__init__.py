"""nn.Modules built on :mod:`attnzoo.ops`."""
