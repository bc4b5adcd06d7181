"""imgpipe.registry"""
