"""What every call to a store goes through: URLs, retries, error wrapping, threads.

Imports only the errors and the backends' table (for a URL's backend). Nothing here knows the
checkpoint format.
"""
