"""``python -m modeld`` runs the CLI."""

from modeld.cli import main

if __name__ == "__main__":
    main()
