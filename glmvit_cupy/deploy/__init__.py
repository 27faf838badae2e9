"""GlmVit in many processes and hosts, and as an HTTP service.

Separate because it stands on the whole library (`GlmVit`, the pipeline) and brings what the
library alone never needs: more processes, an optional extra (ray, serve), a network.
"""
