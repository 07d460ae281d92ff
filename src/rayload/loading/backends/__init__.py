"""loading/backends"""
