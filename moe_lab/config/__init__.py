from moe_lab.config.help import register_help
from moe_lab.config.options import Options, build_options
from moe_lab.config.schema import register
from moe_lab.config.validate import validate
from moe_lab.runtime.errors import ConfigError

__all__ = ["ConfigError", "Options", "build_options", "register", "register_help", "validate"]
