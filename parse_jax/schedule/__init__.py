"""Scheduling: what a forward pass costs on this hardware (`costs`, measured by `profile`) and the speculation
policy that decides from those costs whether, and how much, to speculate (`policy`)."""
