from think_scripted.server import main

main()
