"""imgpipe.pipeline"""
