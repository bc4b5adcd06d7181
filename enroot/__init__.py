"""imgpipe.enroot"""
