"""horovod.common, provided by gradsync."""
