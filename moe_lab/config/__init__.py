from moe_lab.config.errors import ConfigError
from moe_lab.config.schema import register
from moe_lab.config.validate import validate

__all__ = ["ConfigError", "register", "validate"]
