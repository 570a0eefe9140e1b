from .training.cli import main

# (guarded: a tool that imports every module, as the docs site's API reference does, must not run the CLI)
if __name__ == "__main__":
    raise SystemExit(main())
