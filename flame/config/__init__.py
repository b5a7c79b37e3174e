"""flame's job configuration: torchtitan's JobConfig plus flame's sections and aliases."""
