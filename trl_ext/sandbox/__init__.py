"""Sandboxes for an agent's code: `trl_ext.sandbox.base` (limits, results, the backend interface, `choose`), the
bubblewrap backend (`trl_ext.sandbox.bwrap`) and the Docker backend (`trl_ext.sandbox.docker`)."""
