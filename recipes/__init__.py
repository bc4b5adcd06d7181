"""imgpipe.recipes"""
