"""Plain English words for RULER's keys (``adjective-noun``, as RULER draws them) and for common words
extraction. RULER takes its lists from the ``wonderwords`` package; these are rope-extend's own, written
for this project: everyday adjectives, nouns and verbs, lower case, one word each."""

from __future__ import annotations


def _words(text: str) -> list[str]:
    return text.split()


ADJECTIVES = _words(
    """
able acid angry ancient bitter black blue bold brave breezy bright broad broken busy calm careful cheap
cheerful clean clever close cloudy cold cool crisp crooked cruel curly damp dark dear deep dense dry dull
eager early easy elegant empty equal even exact faint fair false famous fancy fast fierce fine firm flat
fluffy fond foolish fragile free fresh friendly full funny gentle giant glad gloomy golden good grand
great green grumpy hairy handsome happy hard harsh heavy hidden high hollow honest huge humble hungry icy
idle jolly juicy keen kind large late lazy light little lively lonely long loose loud lovely low loyal
lucky mad magic mellow mighty mild misty modern narrow nasty neat nervous new nice noisy odd old open
orange pale patient plain pleasant plump polite poor proud purple quick quiet rapid rare raw ready red
rich right rough round royal rude rusty sad safe salty scary sharp shiny short shy silent silky silver
simple sleepy slim slow small smart smooth soft solid sour spare spicy steady steep sticky stiff still
strange strict strong sturdy sudden sunny super sweet swift tall tame tender thick thin tidy tiny tired
tough tricky true ugly vast violet warm weak wealthy wet white whole wicked wide wild windy wise witty
wooden young yellow zealous
"""
)

NOUNS = _words(
    """
acorn actor airport anchor angle animal apple apron arch arm army arrow artist attic aunt baby bag bakery
balloon banana band bank barn basket bath beach bean bear bed bee bell belt bench berry bicycle bird
blanket boat bone book boot bottle box boy bread brick bridge brother brush bucket building bus butter
button cabin cake camel camera candle canoe canyon car card carpet carrot castle cat cave chair cheese
cherry chicken child church circle city clock cloud coat coffee coin comet cook corn cottage cousin cow
crab crayon cup curtain daisy desk diamond dinner dog doll door dragon drawer dream dress drum duck eagle
earth egg elbow engine eye face farm feather fence field finger fire fish flag flower flute fog foot
forest fork fountain fox frog garden gate ghost gift giraffe glass glove goat gold grape grass guitar
hammer hand harbor hat hawk heart hill honey horse hotel house island jacket jar jelly jewel kettle key
king kitchen kite knee knife ladder lake lamp leaf lemon letter library lion lizard lock machine map
market meadow milk mirror monkey moon mountain mouse nail needle nest night ocean onion orchard owl
paint palace pan paper parrot pear pebble pen pencil pepper piano picture pillow pine planet plate pond
potato pumpkin puzzle queen rabbit radio rain river road robot rock roof room rope rose sail salt sand
school sea seed shadow sheep shell ship shoe shop shovel sister sky snake snow sock song spoon spring
squirrel star stone storm street sugar sun swan table tail teacher tent thread tiger toast tomato tower
town toy train tree truck tulip turtle umbrella valley vase village violin wagon wall watch water whale
wheel window wing winter wolf wood yard zebra
"""
)

VERBS = _words(
    """
accept admire answer arrive ask bake balance bathe beg behave believe blink boil borrow bounce breathe
build burn calculate carry chase cheer chew clap climb collect comb count crawl cross cry dance decide
deliver dig dive drag draw dream drift drink drive earn enjoy escape explain fetch fill fix float fold
follow gather glow grab greet grin guard guess hammer hang help hike hop hug hunt hurry invent jog juggle
jump kick kneel knit knock laugh learn lift listen march melt mend mix nod open paddle paint pause peel
plant play point polish pour pray promise pull push race rattle reach read relax remember repair rescue
rest ride ring roll row rush scatter scream scrub search shake shiver shout sing skate skip sleep slide
smile sneeze snore spill spin splash sprint squeeze stack stare steer stir stretch swim swing talk tap
teach throw tickle tiptoe travel trot tumble twist unlock vanish wade wait walk wander wash watch wave
whisper whistle wiggle win wink wish wobble wonder worry yawn yell zoom
"""
)
