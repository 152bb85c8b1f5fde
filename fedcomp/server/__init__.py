"""Server side: the ServerApp (``fedcomp.server.app:app``) and results files."""
