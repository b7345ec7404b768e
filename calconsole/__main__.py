from .cli import main

if __name__ == "__main__":  # guarded: the numerics worker is spawned and re-imports __main__
    raise SystemExit(main())
