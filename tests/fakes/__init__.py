"""Fakes that more than one test module drives, imported from here rather than from another test module:
`training` (the controller's fake worker groups and the helpers that run a Controller on them) and `serving` (the
serving engine's fake grid on one process and its requests)."""
