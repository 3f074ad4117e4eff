"""Paper reproductions: each module has ``main(argv) -> int`` and is run by ``dpopt reproduce NAME``."""
