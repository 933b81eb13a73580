"""MoE Workbench: the Qt window and the command line."""
