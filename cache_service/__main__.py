import sys

from pagedkv import libc

libc.die_with_launcher()  # first: a launcher killed from here on takes this process with it

if len(sys.argv) > 1 and sys.argv[1] == "sizing":
    from cache_service.api.sizing_cli import main as sizing_main

    sys.exit(sizing_main(sys.argv[2:]))

from cache_service.api.server import main
from pagedkv.serving import exit_process

exit_process(main(sys.argv[1:]))
