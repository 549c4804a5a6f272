class ConfigError(ValueError):
    """A configuration that cannot run; names the offending key and what is allowed."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")
