"""``python -m greend.daemon_main``: the ``greend`` command without an installed script."""

from greend.cli.greend_cmd import daemon_main

if __name__ == "__main__":
    daemon_main()
