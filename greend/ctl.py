"""``python -m greend.ctl``: the ``greenctl`` command without an installed script."""

from greend.cli.greenctl import ctl_main

if __name__ == "__main__":
    ctl_main()
